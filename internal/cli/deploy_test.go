package cli

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// TestKubernetesExample: deploy/kubernetes/idem-sidecar.yaml configures a
// proxy that starts (its file and flags are valid), and its ports, probes
// and grace period agree with that configuration.
func TestKubernetesExample(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "deploy", "kubernetes", "idem-sidecar.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	type probe struct {
		HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
	}
	type container struct {
		Name  string
		Args  []string
		Ports []struct {
			Name          string
			ContainerPort int `yaml:"containerPort"`
		}
		Readiness probe `yaml:"readinessProbe"`
		Liveness  probe `yaml:"livenessProbe"`
		Lifecycle struct {
			PreStop struct {
				Sleep struct{ Seconds int }
			} `yaml:"preStop"`
		}
	}
	var (
		config string
		grace  int
		idem   []container
		others []container // beside idem in its pod: the API
	)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var doc struct {
			Kind string
			Data map[string]string
			Spec struct {
				Template struct {
					Spec struct {
						Grace      int `yaml:"terminationGracePeriodSeconds"`
						Containers []container
					}
				}
			}
		}
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if doc.Kind == "ConfigMap" {
			config = doc.Data["idem.yaml"]
		}
		for _, c := range doc.Spec.Template.Spec.Containers {
			if c.Name == "idem" {
				idem, grace = append(idem, c), doc.Spec.Template.Spec.Grace
				others = slices.DeleteFunc(slices.Clone(doc.Spec.Template.Spec.Containers), func(c container) bool { return c.Name == "idem" })
			}
		}
	}
	if config == "" || len(idem) != 1 || len(idem[0].Args) < 1 || idem[0].Args[0] != "proxy" {
		t.Fatalf("want an idem.yaml (%d bytes) and one idem container running the proxy (%+v)", len(config), idem)
	}
	c := idem[0]
	if c.Readiness.HTTPGet != (struct{ Path, Port string }{"/readyz", "admin"}) || c.Liveness.HTTPGet != (struct{ Path, Port string }{"/healthz", "admin"}) {
		t.Errorf("the idem container's probes: %+v %+v", c.Readiness, c.Liveness)
	}
	path := filepath.Join(t.TempDir(), "idem.yaml")
	os.WriteFile(path, []byte(config), 0o600)
	args := slices.Clone(c.Args[1:])
	if i := slices.Index(args, "/etc/idem/idem.yaml"); i >= 0 {
		args[i] = path
	}
	cfg, _, err := loadProxyConfig(args, envOf(map[string]string{"IDEM_STORE": "postgres://idem@postgres:5432/payments"}), io.Discard, io.Discard)
	if err != nil {
		t.Fatalf("the example's configuration: %v", err)
	}
	ports := map[string]string{}
	for _, p := range c.Ports {
		ports[p.Name] = strconv.Itoa(p.ContainerPort)
	}
	for name, addr := range map[string]string{"http": cfg.Listen, "admin": cfg.AdminListen} {
		if _, port, _ := net.SplitHostPort(addr); port != ports[name] {
			t.Errorf("port %s is %q; the configuration listens on %s", name, ports[name], addr)
		}
	}
	// The proxy stops accepting at SIGTERM: the Service must have dropped
	// the pod by then (a preStop sleep), and the grace period must hold the
	// sleep and the whole shutdown.
	sleep := time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	if sleep <= 0 {
		t.Errorf("the idem container has no preStop sleep: connections are refused while endpoints update")
	}
	if time.Duration(grace)*time.Second <= sleep+cfg.ShutdownTimeout {
		t.Errorf("terminationGracePeriodSeconds %d is not above the preStop sleep %v plus shutdown_timeout %v", grace, sleep, cfg.ShutdownTimeout)
	}
	// Kubernetes sends SIGTERM to every container of the pod at once: the
	// API must serve the requests the proxy finishes meanwhile.
	for _, api := range others {
		if apiSleep := time.Duration(api.Lifecycle.PreStop.Sleep.Seconds) * time.Second; apiSleep < sleep+cfg.ShutdownTimeout {
			t.Errorf("the %s container stops after a preStop sleep of %v, before idem has drained (%v and shutdown_timeout %v): requests in flight end UNKNOWN",
				api.Name, apiSleep, sleep, cfg.ShutdownTimeout)
		}
	}
}

// TestDockerfileSettings: the variables the image sets are settings.
func TestDockerfileSettings(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, s := range proxySettings() {
		known[s.env] = true
	}
	vars := regexp.MustCompile(`\b(IDEM_[A-Z_]+)=`).FindAllStringSubmatch(string(data), -1)
	if len(vars) == 0 {
		t.Fatal("the Dockerfile sets no IDEM_ variable")
	}
	for _, v := range vars {
		if !known[v[1]] {
			t.Errorf("the Dockerfile sets %s, which is not a setting", v[1])
		}
	}
	var stdout, stderr strings.Builder
	if code := Main(context.Background(), []string{"help"}, envOf(nil), &stdout, &stderr); code != 0 {
		t.Fatalf("idem help (the image's default command): %d %s", code, stderr.String())
	}
}
